"""The range causal softmax kernel against a pure-Python reference, and its layout checks."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import InvalidInputError
from seqpack.nn import _softmax
from seqpack.nn.softmax import range_softmax_backward, range_softmax_forward

pytestmark = pytest.mark.kernel


def reference_forward(scores, lengths, starts):
    """Loop over grids and queries: normalize keys [start, query] of valid queries only."""
    grids, width, _ = scores.shape
    out = np.zeros_like(scores)
    for grid in range(grids):
        for query in range(int(lengths[grid])):
            keys = range(int(starts[grid, query]), query + 1)
            top = max(scores[grid, query, key] for key in keys)
            weights = {key: math.exp(scores[grid, query, key] - top) for key in keys}
            total = sum(weights.values())
            for key in keys:
                out[grid, query, key] = weights[key] / total
    return out


def reference_backward(probabilities, upstream, lengths, starts):
    grids = probabilities.shape[0]
    out = np.zeros_like(probabilities)
    for grid in range(grids):
        for query in range(int(lengths[grid])):
            keys = range(int(starts[grid, query]), query + 1)
            dot = sum(probabilities[grid, query, key] * upstream[grid, query, key] for key in keys)
            for key in keys:
                out[grid, query, key] = probabilities[grid, query, key] * (upstream[grid, query, key] - dot)
    return out


def segment_starts(segment_lengths, width):
    """Starts of contiguous segments laid out from column 0; columns past them get 0."""
    starts = np.zeros(width, dtype=np.int32)
    column = 0
    for length in segment_lengths:
        starts[column : column + length] = column
        column += length
    return starts


@st.composite
def layouts(draw):
    grids = draw(st.integers(1, 4))
    width = draw(st.integers(1, 9))
    lengths = np.array([draw(st.integers(0, width)) for _ in range(grids)], dtype=np.int64)
    starts = np.array(
        [[draw(st.integers(0, query)) for query in range(width)] for _ in range(grids)], dtype=np.int32
    )
    seed = draw(st.integers(0, 2**32 - 1))
    return lengths, starts, np.random.default_rng(seed)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(layouts())
def test_forward_and_backward_match_the_reference_on_random_layouts(layout):
    lengths, starts, rng = layout
    grids, width = starts.shape
    scores = rng.normal(0.0, 3.0, (grids, width, width))
    upstream = rng.normal(size=(grids, width, width))
    probabilities = range_softmax_forward(scores, lengths, starts)
    np.testing.assert_allclose(probabilities, reference_forward(scores, lengths, starts), rtol=1e-13, atol=1e-15)
    dscores = range_softmax_backward(probabilities, upstream, lengths, starts)
    expected = reference_backward(probabilities, upstream, lengths, starts)
    np.testing.assert_allclose(dscores, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("width", [1, 2, 3, 17, 127, 128, 129])
def test_segment_layouts_at_edge_widths(width):
    rng = np.random.default_rng(width)
    # One-token segments, a row-filling segment, an all-padding grid, and mixed segments.
    layouts = [
        ([1] * width, width),
        ([width], width),
        ([], 0),
        ([min(3, width), 1, 5], min(width, min(3, width) + 6)),
    ]
    lengths = np.array([valid for _, valid in layouts], dtype=np.int64)
    starts = np.stack([segment_starts(segments, width) for segments, _ in layouts])
    scores = rng.normal(0.0, 4.0, (len(layouts), width, width))
    upstream = rng.normal(size=scores.shape)
    probabilities = range_softmax_forward(scores, lengths, starts)
    np.testing.assert_allclose(probabilities, reference_forward(scores, lengths, starts), rtol=1e-13, atol=1e-15)
    dscores = range_softmax_backward(probabilities, upstream, lengths, starts)
    np.testing.assert_allclose(
        dscores, reference_backward(probabilities, upstream, lengths, starts), rtol=1e-12, atol=1e-14
    )
    assert lengths[2] == 0 and not probabilities[2].any() and not dscores[2].any()


def test_inactive_queries_and_excluded_keys_are_exact_zeros_and_never_read():
    rng = np.random.default_rng(0)
    width = 6
    lengths = np.array([4, 6], dtype=np.int64)
    starts = np.stack([segment_starts([2, 2], width), segment_starts([3, 3], width)])
    scores = rng.normal(size=(2, width, width))
    upstream = rng.normal(size=scores.shape)
    permitted = np.zeros(scores.shape, dtype=bool)
    for grid in range(2):
        for query in range(lengths[grid]):
            permitted[grid, query, starts[grid, query] : query + 1] = True
    assert (~permitted).any() and (~permitted[0, 4:]).all()  # inactive queries occur
    poisoned_scores = np.where(permitted, scores, np.nan)
    poisoned_upstream = np.where(permitted, upstream, np.inf)
    clean = range_softmax_forward(scores, lengths, starts)
    poisoned = range_softmax_forward(poisoned_scores, lengths, starts)
    assert np.array_equal(clean, poisoned)
    assert np.all(clean[~permitted] == 0.0) and not np.signbit(clean).any()
    np.testing.assert_allclose(clean.sum(axis=-1)[permitted.any(axis=-1)], 1.0, rtol=1e-15)
    clean_grad = range_softmax_backward(clean, upstream, lengths, starts)
    poisoned_grad = range_softmax_backward(poisoned, poisoned_upstream, lengths, starts)
    assert np.array_equal(clean_grad, poisoned_grad)
    assert np.all(clean_grad[~permitted] == 0.0) and np.isfinite(poisoned_grad).all()


def test_large_scores_use_the_stable_form():
    scores = np.array([[[1000.0, 0.0], [1000.0, 1000.0]]])
    probabilities = range_softmax_forward(scores)
    assert np.array_equal(probabilities, [[[1.0, 0.0], [0.5, 0.5]]])


def test_leading_axes_and_defaults():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(2, 3, 4, 4))
    lengths = np.array([[4, 2, 0], [1, 3, 4]])
    flat_lengths = lengths.reshape(-1)
    expected = reference_forward(scores.reshape(6, 4, 4), flat_lengths, np.zeros((6, 4), dtype=np.int32))
    # Not np.allclose: its default atol of 1e-8 would pass probabilities off by 1e-9.
    np.testing.assert_allclose(range_softmax_forward(scores, lengths).reshape(6, 4, 4), expected,
                               rtol=1e-13, atol=1e-15)
    full = reference_forward(scores.reshape(6, 4, 4), np.full(6, 4), np.zeros((6, 4), dtype=np.int32))
    np.testing.assert_allclose(range_softmax_forward(scores).reshape(6, 4, 4), full, rtol=1e-13, atol=1e-15)


def test_float32_kernel_matches_float64():
    rng = np.random.default_rng(2)
    width = 8
    lengths = np.array([8, 5], dtype=np.int64)
    starts = np.stack([segment_starts([3, 5], width), segment_starts([5], width)])
    scores = rng.normal(size=(2, width, width))
    upstream = rng.normal(size=scores.shape)
    single = np.empty(scores.shape, dtype=np.float32)
    _softmax.range_softmax_forward(scores.astype(np.float32), lengths, starts, single)
    double = range_softmax_forward(scores, lengths, starts)
    np.testing.assert_allclose(single, double, rtol=1e-5, atol=1e-6)
    dsingle = np.empty(scores.shape, dtype=np.float32)
    _softmax.range_softmax_backward(single, upstream.astype(np.float32), lengths, starts, dsingle)
    np.testing.assert_allclose(dsingle, range_softmax_backward(double, upstream, lengths, starts), rtol=1e-4, atol=1e-5)


def test_read_only_fortran_and_strided_inputs_are_accepted():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(2, 5, 5))
    lengths = np.array([5, 3], dtype=np.int32)
    starts = np.stack([segment_starts([2, 3], 5), segment_starts([3], 5)]).astype(np.int64)
    expected = range_softmax_forward(scores, lengths, starts)
    frozen = scores.copy()
    frozen.flags.writeable = False
    assert np.array_equal(range_softmax_forward(frozen, lengths, starts), expected)
    assert np.array_equal(range_softmax_forward(np.asfortranarray(scores), lengths, starts), expected)
    wide = np.zeros((2, 5, 10))
    wide[:, :, ::2] = scores
    assert np.array_equal(range_softmax_forward(wide[:, :, ::2], lengths, starts), expected)


def test_layout_errors_name_grid_and_query_beside_their_exact_limits():
    scores = np.zeros((2, 3, 3))
    range_softmax_forward(scores, [3, 0], [[0, 1, 2], [0, 0, 0]])  # length == T, start == query
    with pytest.raises(InvalidInputError, match="expected 2 causal lengths"):
        range_softmax_forward(scores, [3])
    with pytest.raises(InvalidInputError, match="grid 1 has causal length 4; T is 3"):
        range_softmax_forward(scores, [3, 4])
    with pytest.raises(InvalidInputError, match="grid 0 has causal length -1"):
        range_softmax_forward(scores, [-1, 3])
    with pytest.raises(InvalidInputError, match="grid 1 query 2 has range start 3"):
        range_softmax_forward(scores, [3, 3], [[0, 0, 0], [0, 0, 3]])
    with pytest.raises(InvalidInputError, match="grid 0 query 0 has range start -1"):
        range_softmax_forward(scores, [3, 3], [[-1, 0, 0], [0, 0, 0]])
    # A start past its query is ignored where the query is inactive, even past int64 (review).
    range_softmax_forward(scores, [3, 2], [[0, 0, 0], [0, 0, 3]])
    wide = np.array([[0, 0, 0], [0, 0, 2**64 - 1]], dtype=np.uint64)
    assert np.array_equal(range_softmax_forward(scores, [3, 2], wide), range_softmax_forward(scores, [3, 2]))
    with pytest.raises(InvalidInputError, match=r"starts holds 18446744073709551615, outside the int64"):
        range_softmax_forward(scores, [3, 3], wide)
    with pytest.raises(InvalidInputError, match="one per query"):
        range_softmax_forward(scores, [3, 3], np.zeros((2, 3, 1), dtype=np.int32))
    with pytest.raises(InvalidInputError, match="square grids"):
        range_softmax_forward(np.zeros((2, 3, 4)))
    with pytest.raises(InvalidInputError, match=r"^probabilities must be square grids"):  # (named "scores": review)
        range_softmax_backward(np.zeros((2, 3, 4)), np.zeros((2, 3, 4)))
    with pytest.raises(InvalidInputError, match="must hold integers"):
        range_softmax_forward(scores, [3.0, 3.0])
