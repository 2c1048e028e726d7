"""The tape, and central finite differences for every op's backward."""

import numpy as np
import pytest

from seqpack import InvalidInputError
from seqpack.nn import attention as A, ops as F, softmax as S
from seqpack.nn.attention import segment_spans
from helpers import numerical_gradient
from seqpack.nn.autograd import Tensor
from seqpack.nn.loss import masked_nll


def check_gradients(op, *arrays, tolerance=1e-7, seed=0):
    """Compare backward against central differences of ``sum(op(*leaves) * weights)``."""
    rng = np.random.default_rng(seed)
    leaves = [Tensor(array.copy(), requires_grad=True) for array in arrays]
    out = op(*leaves)
    weights = rng.normal(size=out.shape)
    out.backward(weights)
    assert all(leaf.grad is not None for leaf in leaves)

    def objective():
        return float(np.sum(op(*leaves).value * weights))

    for leaf in leaves:
        numeric = numerical_gradient(objective, leaf.value)
        scale = max(1.0, float(np.max(np.abs(numeric))))
        np.testing.assert_allclose(leaf.grad, numeric, rtol=0, atol=tolerance * scale)
    return leaves


RNG = np.random.default_rng(42)


def normal(*shape, std=1.0):
    return RNG.normal(0.0, std, shape)


def test_elementwise_and_linear_ops():
    check_gradients(F.add, normal(3, 4), normal(3, 4))
    check_gradients(F.mul, normal(3, 4), normal(3, 4))
    check_gradients(lambda x: F.scale(x, -0.7), normal(2, 3))
    check_gradients(F.transpose, normal(3, 5))
    check_gradients(F.matmul, normal(2, 3, 4), normal(4, 5))
    check_gradients(F.batched_matmul, normal(2, 3, 4, 5), normal(2, 3, 5, 2))
    check_gradients(F.swap_last_axes, normal(2, 3, 4))
    check_gradients(F.silu, normal(4, 5, std=3.0))


def test_silu_saturates_without_overflow():
    out = F.silu(Tensor(np.array([-1e4, 1e4]), requires_grad=True))
    out.backward()
    assert np.array_equal(out.value, [-0.0, 1e4]) and np.isfinite(out._parents[0].grad).all()


def test_rmsnorm():
    leaves = check_gradients(lambda x, g: F.rmsnorm(x, g, 1e-5), normal(2, 3, 6), normal(6))
    x = leaves[0].value
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-5) * leaves[1].value
    assert np.array_equal(F.rmsnorm(leaves[0], leaves[1]).value, expected)


def test_rmsnorm_of_a_zero_row_is_zero_with_finite_gradient():
    x = Tensor(np.zeros((1, 4)), requires_grad=True)
    gain = Tensor(np.ones(4), requires_grad=True)
    out = F.rmsnorm(x, gain)
    out.backward(np.ones((1, 4)))
    assert not out.value.any() and np.isfinite(x.grad).all() and not gain.grad.any()


def test_select_cells_blocks_nan_and_its_gradient():
    active = np.array([[True, False, True]])
    check_gradients(lambda x: F.select_cells(x, active), normal(1, 3, 2))
    x = Tensor(np.full((1, 3, 2), np.nan), requires_grad=True)
    out = F.select_cells(x, active)
    out.backward(np.ones((1, 3, 2)))
    assert not out.value[0, 1].any() and not x.grad[0, 1].any()


def test_embedding():
    ids = np.array([[3, 0, -1], [3, 3, 1]], dtype=np.int32)
    check_gradients(lambda table: F.embedding(table, ids), normal(4, 5))


def test_rotary_matches_the_rotate_half_definition_and_skips_inactive_cells():
    positions = np.array([[0, 1, 2, 0], [0, 1, 0, 1]])
    active = np.array([[True, True, True, False], [True, True, True, True]])
    check_gradients(lambda x: F.rotary(x, positions, active), normal(2, 3, 4, 6))
    x = normal(2, 3, 4, 6)
    out = F.rotary(Tensor(x), positions, active).value
    half = 3
    angle = positions[1, 3] * 10000.0 ** (-2.0 * np.arange(half) / 6)
    x1, x2 = x[1, 2, 3, :half], x[1, 2, 3, half:]
    expected = np.concatenate((x1 * np.cos(angle) - x2 * np.sin(angle), x1 * np.sin(angle) + x2 * np.cos(angle)))
    np.testing.assert_allclose(out[1, 2, 3], expected, rtol=1e-14)
    assert np.array_equal(out[0, :, 3], x[0, :, 3])


def test_head_split_and_merge():
    check_gradients(lambda x: F.split_heads(x, 2), normal(2, 3, 6))
    check_gradients(F.merge_heads, normal(2, 3, 4, 5))
    x = normal(2, 3, 6)
    heads = F.split_heads(Tensor(x), 3).value
    assert np.array_equal(heads[1, 2, 0], x[1, 0, 4:6])
    assert np.array_equal(F.merge_heads(Tensor(heads)).value, x)


def test_range_softmax_at_segment_edges():
    lengths = np.array([[5, 3], [0, 4]])
    starts = np.array([[[0, 0, 2, 2, 4], [0, 1, 1, 0, 0]], [[0] * 5, [0, 0, 2, 3, 0]]])
    check_gradients(lambda s: S.range_softmax(s, lengths, starts), normal(2, 2, 5, 5, std=2.0))


# Per row: valid length and segment starts (contiguous segments, as batches carry them).
LENGTHS = np.array([6, 4, 0])
STARTS = np.array([[0, 0, 2, 2, 2, 5], [0, 1, 2, 2, 0, 0], [0] * 6])


@pytest.mark.parametrize("attention", [A.causal_attention_with_ranges, A.fused_range_attention])
def test_range_attention(attention):
    q, k, v = normal(3, 2, 6, 4), normal(3, 2, 6, 4), normal(3, 2, 6, 4)
    check_gradients(lambda q, k, v: attention(q, k, v, LENGTHS, STARTS), q, k, v)
    assert segment_spans(LENGTHS, STARTS).shape[0] == 6  # the layout is one the fused kernel accepts


def test_lengths_and_plain_causal_variants():
    q, k, v = normal(2, 5, 4), normal(2, 5, 4), normal(2, 5, 4)
    lengths = np.array([5, 2])
    check_gradients(lambda q, k, v: A.causal_attention_with_lengths(q, k, v, lengths), q, k, v)
    check_gradients(A.causal_attention, q, k, v)
    ranged = A.causal_attention_with_ranges(Tensor(q), Tensor(k), Tensor(v), lengths, np.zeros((2, 5), int))
    assert np.array_equal(A.causal_attention_with_lengths(Tensor(q), Tensor(k), Tensor(v), lengths).value, ranged.value)
    assert not ranged.value[1, 2:].any()
    full = A.causal_attention(Tensor(q), Tensor(k), Tensor(v)).value
    scores = q @ np.swapaxes(k, -1, -2) / 2.0
    scores[:, np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(full, weights / weights.sum(-1, keepdims=True) @ v, rtol=1e-12)


def test_masked_nll():
    targets = np.array([[2, 0, -1], [1, 1, 3]])
    mask = targets >= 0
    check_gradients(lambda z: masked_nll(z, targets, mask).tensor, normal(2, 3, 4, std=2.0))


def test_tape_accumulates_reuse_and_repeats_backward():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = F.add(F.mul(x, x), F.scale(x, 3.0))  # x**2 + 3x, x used three times
    y.backward(np.ones(2))
    assert np.array_equal(x.grad, 2 * x.value + 3)
    y.backward(np.ones(2))
    assert np.array_equal(x.grad, 2 * x.value + 3)


def test_intermediate_gradients_and_constants():
    x = Tensor(np.array([1.0, -2.0]), requires_grad=True)
    constant = Tensor(np.array([5.0, 5.0]))
    hidden = F.mul(x, constant)
    out = F.silu(hidden)
    out.backward(np.ones(2))
    assert hidden.grad is not None and constant.grad is None
    assert np.array_equal(x.grad, hidden.grad * 5.0)
    detached = F.silu(constant)
    assert not detached.requires_grad


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_poisoned_padded_attention_scores_change_nothing(poison):
    """NaN/inf in every score outside the permitted ranges (padding included) is never read."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(3, 2, 6, 4)) for _ in range(3))
    permitted = np.zeros((3, 2, 6, 6), dtype=bool)
    for row, length in enumerate(LENGTHS):
        for query in range(length):
            permitted[row, :, query, STARTS[row, query] : query + 1] = True
    assert (~permitted[2]).all() and permitted[0].any()
    weights = rng.normal(size=q.shape)

    def run(offset):
        leaves = [Tensor(array, requires_grad=True) for array in (q, k, v)]
        scores = F.scale(F.batched_matmul(leaves[0], F.swap_last_axes(leaves[1])), 0.5)
        probabilities = S.range_softmax(F.add(scores, offset), np.repeat(LENGTHS, 2), np.repeat(STARTS, 2, axis=0))
        out = F.batched_matmul(probabilities, leaves[2])
        out.backward(weights)
        return out.value, [leaf.grad for leaf in leaves]

    clean_out, clean_grads = run(np.zeros(permitted.shape))
    dirty_out, dirty_grads = run(np.where(permitted, 0.0, poison))
    assert np.array_equal(clean_out, dirty_out) and np.isfinite(dirty_out).all()
    assert not dirty_out[2].any()
    for clean, dirty in zip(clean_grads, dirty_grads):
        assert np.array_equal(clean, dirty) and np.isfinite(dirty).all()
    reference = A.causal_attention_with_ranges(Tensor(q), Tensor(k), Tensor(v), LENGTHS, STARTS).value
    assert np.array_equal(reference, clean_out)


# --- the dense reference attention's input checks ----------------------------------------


# Regression: NaN in padded cells reached the reference attention's values and gradients.
def test_reference_attention_ignores_nan_in_padding():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 4, 4)) for _ in range(3))
    lengths, starts = np.array([4, 2]), np.zeros((2, 4), int)
    leaves = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    clean = A.causal_attention_with_ranges(*leaves, lengths, starts)
    clean.backward(np.ones(clean.shape))
    dirty_values = [x.copy() for x in (q, k, v)]
    for x in dirty_values:
        x[1, :, 2:] = np.nan
    dirty_leaves = [Tensor(x, requires_grad=True) for x in dirty_values]
    dirty = A.causal_attention_with_ranges(*dirty_leaves, lengths, starts)
    dirty.backward(np.ones(dirty.shape))
    assert np.array_equal(clean.value, dirty.value)  # inactive queries: zero mixture, not NaN
    assert not dirty.value[1, :, 2:].any()
    for a, b in zip(leaves, dirty_leaves):
        assert np.array_equal(a.grad, b.grad)
    fused = A.fused_range_attention(*(Tensor(x) for x in dirty_values), lengths, starts)
    np.testing.assert_allclose(fused.value, dirty.value, rtol=1e-12, atol=1e-14)


# Regression: keys or values of one row were broadcast silently across every row.
def test_reference_attention_does_not_broadcast_keys_across_rows():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 4, 3)) for _ in range(3))
    lengths, starts = [4, 4], np.zeros((2, 4), int)
    A.causal_attention_with_ranges(Tensor(q), Tensor(k), Tensor(v), lengths, starts)
    with pytest.raises(InvalidInputError, match=r"k has shape \(1, 4, 3\)"):
        A.causal_attention_with_ranges(Tensor(q), Tensor(k[:1]), Tensor(v), lengths, starts)
    with pytest.raises(InvalidInputError, match=r"v has shape \(1, 4, 3\)"):
        A.causal_attention_with_ranges(Tensor(q), Tensor(k), Tensor(v[:1]), lengths, starts)
    q4 = rng.standard_normal((2, 2, 4, 4))  # one shared key/value head still works
    shared = A.causal_attention_with_ranges(Tensor(q4), Tensor(q4[:, :1]), Tensor(q4[:, :1]), lengths, starts)
    fused = A.fused_range_attention(Tensor(q4), Tensor(q4[:, :1]), Tensor(q4[:, :1]), lengths, starts)
    np.testing.assert_allclose(shared.value, fused.value, rtol=1e-12, atol=1e-14)


def test_reference_attention_gradients_of_a_shared_head_sum_over_its_query_heads():
    # Its backward failed to reshape dk and dv (review).
    rng = np.random.default_rng(3)
    q, k, v, weights = rng.standard_normal((2, 3, 5, 4)), *rng.standard_normal((2, 2, 1, 5, 4)), \
        rng.standard_normal((2, 3, 5, 4))
    lengths, starts = np.array([5, 3]), np.array([[0, 0, 2, 2, 2], [0, 1, 1, 0, 0]])
    runs = []
    for attention in (A.causal_attention_with_ranges, A.fused_range_attention):
        leaves = [Tensor(x, requires_grad=True) for x in (q, k, v)]
        attention(*leaves, lengths, starts).backward(weights)
        runs.append([leaf.grad for leaf in leaves])
    for reference, fused in zip(*runs):
        assert reference.shape == fused.shape
        np.testing.assert_allclose(reference, fused, rtol=1e-9, atol=1e-10)


def test_reference_attention_drops_the_gradient_of_inactive_queries():
    # A NaN there reached dv of valid keys through P^T @ grad (review); the fused kernel never reads it.
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    lengths, starts = np.array([4, 2]), np.zeros((2, 4), int)
    weights = rng.standard_normal(q.shape)
    poisoned = weights.copy()
    poisoned[1, :, 2:] = np.nan
    grads = []
    for upstream in (weights, poisoned):
        leaves = [Tensor(x, requires_grad=True) for x in (q, k, v)]
        A.causal_attention_with_ranges(*leaves, lengths, starts).backward(upstream)
        grads.append([leaf.grad for leaf in leaves])
    for clean, dirty in zip(*grads):
        assert np.isfinite(dirty).all() and np.array_equal(clean, dirty)


# Regression: a NaN in one segment's v reached the other segment through the dense P @ V.
def test_reference_attention_refuses_a_non_finite_valid_cell():
    """A NaN in one segment's v would reach the other segment through the dense P @ V."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 4)) for _ in range(3))
    starts = np.array([[0, 0, 0, 3, 3, 3]])
    v[0, 1, 2] = np.nan
    with pytest.raises(InvalidInputError, match=r"v holds nan at row 0, cell 1"):
        A.causal_attention_with_ranges(q, k, v, np.array([6]), starts)
    v[0, 1, 2] = np.inf
    with pytest.raises(InvalidInputError, match=r"v holds inf at row 0, cell 1"):
        A.causal_attention_with_ranges(q, k, v, np.array([6]), starts)
